// Running other programs from the CLI: keel's own executable (for `keel train` children, under
// mpirun or not) and a check that a program is installed before trying to run it.
#pragma once
#include <string>
#include <vector>

namespace keel::cli {

// The path of the running keel binary (/proc/self/exe).
std::string this_executable();

// keel::Error naming the package to install when `program` is not on PATH (execvp would only say
// ENOENT).
void require_on_path(const std::string& program);

// Runs argv[0] (searched on PATH) with stdout and stderr appended to `log_path`, waits for it
// and returns its exit status (128 + the signal when a signal ended it).
int run_and_wait(const std::vector<std::string>& argv, const std::string& log_path);

// Runs argv[0] with stdout inherited and stderr passed through line by line, and returns its exit
// status, as exec would have. Once a line containing `fatal_marker` has passed (a rank giving up on
// a silent peer), the program gets `grace_s` seconds to end on its own, then SIGKILL:
// mpirun can wait minutes for the daemon of a host whose link is down, after the ranks are done.
// The status is then 2, the failing rank's.
int run_supervised(const std::vector<std::string>& argv, const std::string& fatal_marker, double grace_s);

}  // namespace keel::cli
