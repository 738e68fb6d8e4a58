"""The MoE layer: router, grouped experts, token dispatch (local and all-to-all), balancing, the MoE decoder's
hooks and how the experts split over expert-parallel ranks."""
