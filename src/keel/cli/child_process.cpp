#include "keel/cli/child_process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <system_error>

#include "keel/core/error.h"

namespace keel::cli {

std::string this_executable() {
  char buffer[PATH_MAX];
  ssize_t n = ::readlink("/proc/self/exe", buffer, sizeof buffer - 1);
  require(n > 0, "cannot find keel's own path in /proc/self/exe: {}", std::system_category().message(errno));
  return std::string(buffer, size_t(n));
}

void require_on_path(const std::string& program) {
  if (program.find('/') != std::string::npos) {
    require(::access(program.c_str(), X_OK) == 0, "{}: not an executable file", program);
    return;
  }
  const char* path = std::getenv("PATH");
  std::string dirs = path ? path : "/usr/bin:/bin";
  size_t start = 0;
  while (start <= dirs.size()) {
    size_t end = dirs.find(':', start);
    std::string dir = dirs.substr(start, end == std::string::npos ? std::string::npos : end - start);
    if (::access(((dir.empty() ? "." : dir) + "/" + program).c_str(), X_OK) == 0) return;
    if (end == std::string::npos) break;
    start = end + 1;
  }
  fail("{} not found on PATH: keel runs OpenMPI's mpirun for data-parallel jobs (Debian: apt-get install openmpi-bin)",
       program);
}

namespace {

// Starts argv[0] (searched on PATH) with its stdout and stderr on the given descriptors (-1: this
// process's own); fails naming the program when fork does.
pid_t start_child(const std::vector<std::string>& argv, int out_fd, int err_fd) {
  std::vector<std::string> words = argv;
  std::vector<char*> args;
  for (auto& word : words) args.push_back(word.data());
  args.push_back(nullptr);
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t pid = ::fork();
  if (pid < 0) fail("cannot start {}: {}", argv[0], std::strerror(errno));
  if (pid == 0) {  // the child: only async-signal-safe calls until exec
    if (out_fd >= 0) ::dup2(out_fd, STDOUT_FILENO);
    if (err_fd >= 0) ::dup2(err_fd, STDERR_FILENO);
    ::execvp(args[0], args.data());
    const char message[] = "keel: exec failed\n";
    [[maybe_unused]] ssize_t w = ::write(STDERR_FILENO, message, sizeof message - 1);
    ::_exit(127);
  }
  return pid;
}

// A waitpid status as a shell reports it: the exit code, or 128 + the signal.
int exit_status(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

}  // namespace

int run_and_wait(const std::vector<std::string>& argv, const std::string& log_path) {
  require(!argv.empty(), "run_and_wait: no program");
  const int log = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  require(log >= 0, "{}: cannot open for writing: {}", log_path, std::strerror(errno));
  pid_t pid = -1;
  try {
    pid = start_child(argv, log, log);
  } catch (...) {
    ::close(log);
    throw;
  }
  ::close(log);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    require(errno == EINTR, "waiting for {}: {}", argv[0], std::strerror(errno));
  }
  return exit_status(status);
}

int run_supervised(const std::vector<std::string>& argv, const std::string& fatal_marker, double grace_s) {
  require(!argv.empty(), "run_supervised: no program");
  int pipe_fds[2];
  require(::pipe2(pipe_fds, O_CLOEXEC) == 0, "cannot make a pipe: {}", std::strerror(errno));
  pid_t pid = -1;
  try {
    pid = start_child(argv, -1, pipe_fds[1]);
  } catch (...) {
    ::close(pipe_fds[0]);
    ::close(pipe_fds[1]);
    throw;
  }
  ::close(pipe_fds[1]);
  // Ctrl-C reaches the child too (same process group): this process outlives it to report.
  struct sigaction ignore {};
  ignore.sa_handler = SIG_IGN;
  struct sigaction old_int {}, old_term {};
  ::sigaction(SIGINT, &ignore, &old_int);
  ::sigaction(SIGTERM, &ignore, &old_term);

  using Clock = std::chrono::steady_clock;
  std::string line;
  bool open = true, fatal = false;
  bool killed = false;  // after the marker and the grace
  Clock::time_point next{};
  int status = 0;
  for (;;) {
    if (::waitpid(pid, &status, WNOHANG) == pid) break;
    // SIGKILL, not SIGTERM: the ranks are done, and Open MPI's orderly shutdown is what waits on
    // the lost daemon (and crashed in PMIx_Finalize when tried).
    if (fatal && !killed && Clock::now() >= next) killed = ::kill(pid, SIGKILL) == 0;
    if (!open) {
      ::usleep(50'000);
      continue;
    }
    pollfd p{pipe_fds[0], POLLIN, 0};
    if (::poll(&p, 1, 100) <= 0) continue;
    char buffer[4096];
    const ssize_t n = ::read(pipe_fds[0], buffer, sizeof buffer);
    if (n <= 0) {
      if (n < 0 && errno == EINTR) continue;
      open = false;  // the child (and everything holding its stderr) closed it
      continue;
    }
    [[maybe_unused]] ssize_t w = ::write(STDERR_FILENO, buffer, size_t(n));
    line.append(buffer, size_t(n));
    for (size_t end; (end = line.find('\n')) != std::string::npos; line.erase(0, end + 1))
      if (!fatal && line.substr(0, end).find(fatal_marker) != std::string::npos) {
        fatal = true;
        next = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(grace_s));
      }
    if (line.size() > 65536) line.clear();  // no newline in sight: not a line to look at
  }
  ::close(pipe_fds[0]);
  ::sigaction(SIGINT, &old_int, nullptr);
  ::sigaction(SIGTERM, &old_term, nullptr);
  return killed ? 2 : exit_status(status);
}

}  // namespace keel::cli
