// meshtrain command-line entry point: maps sub-commands to the library and
// library errors to exit codes (the only place that does).
#include <cstdio>
#include <exception>

#include "meshtrain/base/error.h"

int main(int argc, char** argv) {
  (void)argc;
  (void)argv;
  std::fprintf(stderr, "meshtrain: no sub-command yet\n");
  return 2;
}
