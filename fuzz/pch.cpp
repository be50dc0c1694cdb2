// The translation unit that carries the precompiled <torch/torch.h> (fuzz/CMakeLists.txt).
