"""Long Range Arena from scratch: the five tasks' data (two generated here, three read from a user's folders),
the small LRA encoder with any attention method, its recipes and the run that ``luna-convert lra TASK`` starts.
The modules are listed in CONTRIBUTING.md's Package map."""
