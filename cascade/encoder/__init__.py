"""The encoder tier's models: the ONNX sentence encoder, hashed word n-grams beside it, the
familiarity gate for unfamiliar inputs, and what an ONNX file's weights are stored as."""
