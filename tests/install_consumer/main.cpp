// Links against the installed tandem and calls into several units.
#include <tandem/config.h>
#include <tandem/cpu_features.h>
#include <tandem/doctor.h>
#include <tandem/error.h>

#include <iostream>

int main() {
  auto cfg = tandem::parse_config("cpu:\n  format: int8\n");
  if (cfg.cpu.format != "int8") return 1;
  try {
    tandem::parse_config("cpu:\n  formt: int8\n");
    return 2;
  } catch (const tandem::Error& e) {
    if (e.code() != tandem::Errc::invalid_argument) return 3;
  }
  std::cout << "tandem " << tandem::version() << " isa " << tandem::isa_name(tandem::hardware_isa()) << "\n";
  return 0;
}
