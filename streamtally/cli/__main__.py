import sys

from streamtally.cli import main

sys.exit(main())
