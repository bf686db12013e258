"""A user's client sampler for FairFL, named in the config as `user_sampler.sampler:RoundRobin`."""
