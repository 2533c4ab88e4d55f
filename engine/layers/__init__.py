"""Building blocks shared by the model families: linear layers, norms, rotary embeddings,
vocabulary embeddings, fused experts and the pooler."""
