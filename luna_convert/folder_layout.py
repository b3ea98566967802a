"""The names of the files and folders luna-convert writes, spelled in this one place.

A model folder (``luna_convert.save``) holds the weights, the conversion record and, for transformers
models, their own config. A run folder (``luna-convert run``) holds the run's results, config, teacher
record, logs and plots, and the converted model in ``MODEL_DIR``.
"""

# a model folder
WEIGHTS_FILE = "model.safetensors"
CONVERSION_FILE = "linear_attention.json"  # method, options, architecture: what load() rebuilds
HF_CONFIG_FILE = "config.json"  # transformers' own config, beside the weights

# a run folder
RESULTS_FILE = "results.json"
CONFIG_FILE = "config.json"  # the run's resolved config (what --resume and eval read back)
TEACHER_FILE = "teacher.json"
LOG_FILE = "train_log.jsonl"
STAGES_FILE = "stage_scores.json"  # headline score right after conversion and after distillation
STATE_FILE = "trainer_state.json"
MODEL_DIR = "model"  # the converted model, a model folder
DISTILLED_DIR = "checkpoints/distilled"  # the model after attention distillation, a model folder
CURVES_FILE = "curves.png"
MODEL_CARD_FILE = "README.md"

# a layer selection (keep_softmax_layers auto): in the run folder, beside the chosen set's run
SELECTION_DIR = "selection"  # the search's runs, one folder each, and its config
SELECTION_FILE, SELECTION_TABLE = "layer_selection.json", "layer_selection.md"

# a comparison folder (luna-convert compare)
COMPARE_FILE, TABLE_FILE, PLOT_FILE = "compare.json", "compare.md", "compare.png"
