// The AMX switch and the OS's permission (amx.h).

#include "amx.h"

#include <sys/syscall.h>
#include <unistd.h>

bool amx_enabled = true;

bool amx_available() {
#if defined(PDSERVE_AMX)
  // Linux hands the AMX tile state only to a process that asks for it (oneDNN asks too).
  static const bool permitted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
#else
  return false;
#endif
}
