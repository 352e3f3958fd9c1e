"""``python -m model.import_hf SRC OUT``: see model.evaluation.import_hf."""
import sys

from model.evaluation.import_hf import main

if __name__ == "__main__":
    sys.exit(main())
