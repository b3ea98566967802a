"""``python -m luna_convert`` and ``accelerate launch -m luna_convert ...``."""

from .cli import main

main()
