"""The wine example: train a classifier on scikit-learn's wine data and serve it (README.md)."""
