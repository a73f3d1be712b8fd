import sys

from jdist.export import main

sys.exit(main())
