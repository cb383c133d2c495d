"""python -m kvarn_vllm.ladder: the kvarn-vllm-ladder command."""
import sys

from .cli import main

sys.exit(main())
