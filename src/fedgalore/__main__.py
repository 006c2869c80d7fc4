"""``python -m fedgalore`` runs the ``fedgalore`` command."""
import sys

from fedgalore.cli import main

sys.exit(main())
