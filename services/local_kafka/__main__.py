"""``python -m services.local_kafka COMMAND``: what ``deploy/kafka/kafka.sh`` runs."""

import sys

from services.local_kafka.cluster import main

sys.exit(main())
