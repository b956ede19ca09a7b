// The MPI implementation of dist::Communicator (Open MPI from Debian).
#pragma once
#include <memory>

#include "keel/dist/communicator.h"

namespace keel::dist {

std::unique_ptr<Communicator> make_mpi_communicator(double timeout_s);

}  // namespace keel::dist
