"""`python -m engine.run_batch`: the short form of `python -m engine.entrypoints.openai.run_batch`,
an OpenAI Batch API input file run offline (the command and its flags are that module's)."""

import sys

from engine.entrypoints.openai.run_batch import main

if __name__ == "__main__":
    sys.exit(main())
