"""The training application: `python -m train +experiment=resnet`."""
