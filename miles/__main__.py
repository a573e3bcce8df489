import sys

from miles.cli.main import main

sys.exit(main())
