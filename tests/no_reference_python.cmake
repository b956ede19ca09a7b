# Stands in for the reference Python when the build was configured without KEEL_PYTHON, so that
# the Python tests fail with directions instead of disappearing from the run.
message(FATAL_ERROR "no reference Python environment: configure with "
  "-DKEEL_PYTHON=$(scripts/python-env.sh), or run scripts/test.sh, which does")
