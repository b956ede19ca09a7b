# Stands in for the Python package's tests when the build has no package: fails saying how to get one.
message(FATAL_ERROR "the keel Python package was not built: configure with -DKEEL_PYTHON_PACKAGE=ON and "
                    "-DPython_EXECUTABLE=$(scripts/python-env.sh) (scripts/build.sh does when KEEL_PYTHON is set, "
                    "as scripts/test.sh sets it)")
