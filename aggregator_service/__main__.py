import sys

from aggregator_service.server import main

sys.exit(main())
