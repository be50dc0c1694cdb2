// See third_party/gloo_decls/README.md: declarations only.
#pragma once
