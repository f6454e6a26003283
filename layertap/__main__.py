import sys

from layertap.cli import main

sys.exit(main())
