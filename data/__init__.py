"""The input pipeline: image folders, sample order, datasets, loaders, synthetic data."""
