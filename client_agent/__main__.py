import sys

from client_agent.agent import main

sys.exit(main())
