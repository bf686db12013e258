import sys

from privacy_service.server import main

sys.exit(main())
