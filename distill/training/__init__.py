"""Training the fast tiers on the teacher's labels, into a bundle.

- ``run``: ``train_bundle``, the training run: the split, the encoder tier's heads (one softmax
  head per question on one embedding), the tiers above it, the bundle's manifest.
- ``split``: the deterministic train / calibration / evaluation split of item ids.
- ``head_rule``: which questions get a head, one rule for every tier trained here.
- ``finetune``: the encoder itself fine-tuned on the teacher's answers (torch, an optional extra);
  ``student`` its torch network, loss and loops; ``finetune_base`` what both read (the float
  MiniLM, the targets); ``onnx_export`` the int8 ONNX file the fast tier serves, checked.
- ``mid_layer``: the mid-layer tier: the teacher's states at layer L, a head per question on
  them, L chosen by measurement.
"""
