import sys

from tileport.cli import main

sys.exit(main())
