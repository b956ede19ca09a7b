// The MPI implementation of distributed::Communicator (Open MPI from Debian).
#pragma once
#include <cstdint>
#include <memory>

#include "keel/distributed/communicator.h"

namespace keel::distributed {

std::unique_ptr<Communicator> make_mpi_communicator(double timeout_s);

}  // namespace keel::distributed
