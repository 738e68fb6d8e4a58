"""Parts shared by model families (pure nn.Modules, no trainer knowledge): the Mixture-of-Experts layer."""
