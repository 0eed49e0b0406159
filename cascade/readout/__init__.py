"""llama.cpp: the logit-readout scorer (one prefill per state, questions fanned out), its model
and context, prompts and the prompt head, option orders, where a model runs, and the mid-layer
reader (the layer tap)."""
