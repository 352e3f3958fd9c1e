"""``python -m model.export_hf CHECKPOINT OUT``: see model.evaluation.export_hf."""
import sys

from model.evaluation.export_hf import main

if __name__ == "__main__":
    sys.exit(main())
