import sys

from jdist.launch import main

sys.exit(main())
