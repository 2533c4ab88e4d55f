"""The OpenAI batch file: its lines and bodies to engine inputs and back, a whole file with
resume (`batch`), and its command line (`run_batch`, `python -m engine.run_batch`)."""
