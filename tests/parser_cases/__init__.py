"""vLLM's parser test cases, one module per parser (`CASES`, a list of
`tests.parser_conformance.Case`); tests/engine/test_parser_conformance.py runs them all."""
