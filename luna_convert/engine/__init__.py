"""Training and scoring loops: attention distillation, finetuning, predictions and metrics over loaders."""
