"""The input pipeline: volume, node cache, index, sample order, datasets, loaders, ledger."""
