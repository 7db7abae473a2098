import sys

from .control import main

sys.exit(main())
