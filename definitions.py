"""The Dagster code location: every pipeline in example_pipelines/.

    dagster dev -f definitions.py
"""

import dagster as dg

from example_pipelines import example_batch

defs = dg.Definitions.merge(example_batch.defs)
