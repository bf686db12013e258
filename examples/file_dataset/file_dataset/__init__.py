"""A user's dataset plug-in for FairFL, named in the config as `file_dataset.dataset:CsvFolder`."""
