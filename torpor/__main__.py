import sys

from torpor.cli.main import main

sys.exit(main())
