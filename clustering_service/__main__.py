import sys

from clustering_service.server import main

sys.exit(main())
