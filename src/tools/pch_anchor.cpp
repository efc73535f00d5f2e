// Carries the precompiled LibTorch header that the tools and examples reuse.
