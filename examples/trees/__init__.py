"""Tree models through ONNX Runtime: a scikit-learn forest and a LightGBM model, converted to
ONNX and served (docs/models.md, "Tree and scikit-learn models")."""
