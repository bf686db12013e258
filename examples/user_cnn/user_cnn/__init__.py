"""A user's CNN for FairFL, named in the config as `user_cnn.model:small_cnn`."""
