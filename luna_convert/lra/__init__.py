"""Long Range Arena from scratch: the five tasks' data (``listops`` and ``pathfinder`` generated here, ``folders``
for Image, Text and Retrieval), the small LRA encoder (``model``), its config and recipes (``config``) and the run
(``train``, what ``luna-convert lra TASK`` calls). Imports run one way: ``train`` -> ``config`` -> ``data`` and
``model`` -> the generators."""
