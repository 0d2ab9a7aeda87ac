# packaging/qmoed-cpack.cmake: CPack configuration for the qmoed .deb.
#
#   cmake --build build && cpack --config build/CPackConfig.cmake -G DEB -B build/pkg
#   (or `cmake --build build --target package`)
#
# One binary package, "qmoed", holding everything `cmake --install` places
# (the install rules live with their modules: daemon/, clients/, tools/):
# qmoed, qmoectl, qmoe-bank, libqmoe-client (.so and .a), its header and
# qmoe-client.pc, the systemd units, sysusers/tmpfiles snippets, man pages and
# /etc/qmoed/qmoed.json (a conffile). The package always installs under /usr,
# whatever prefix the build tree was configured with; packaging/stage-fixup.cmake
# makes the staged tree agree with that (see there).
#
# CUDA: the package carries whatever backend the build has. The CUDA backend
# links the CUDA runtime statically (cuda/CMakeLists.txt: CUDA_RUNTIME_LIBRARY
# Static, CUDA::cudart_static), so no libcudart package is needed; it adds
# libstdc++ (found by dpkg-shlibdeps) and loads the driver's libcuda.so.1 at
# run time, which is not a package dependency: without it `backend: auto`
# falls back to the CPU backend. The description says which build it is.

set(CPACK_PACKAGE_NAME qmoed)
set(CPACK_PACKAGE_VENDOR "qmoed")
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGE_CONTACT "qmoed maintainers <maintainers@users.noreply.a-seed-e69f879a.example>")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "MoE expert-residency daemon for ONNX Runtime QMoE layers")
# The DEB generator's own default prefix is /usr; not set here, or the
# source tarball would nest the tree under usr/ too.
set(qm__pkg_prefix /usr)
set(CPACK_GENERATOR DEB)
set(CPACK_STRIP_FILES OFF)

if(QMOE_HAVE_CUDA)
  set(qm__pkg_backend
      "This build includes the CUDA backend (CUDA runtime linked statically).\nIt uses the NVIDIA driver's libcuda.so.1 when present; without a driver,\nthe default backend (auto) falls back to the CPU backend.")
else()
  set(qm__pkg_backend "This build has the CPU backend only (built without CUDA).")
endif()
# The extended description: CPack puts the summary first, indents each line
# by one space and turns empty lines into " .".
set(CPACK_DEBIAN_PACKAGE_DESCRIPTION
"qmoed serves the expert layers of ONNX Runtime com.microsoft.QMoE models
over a local socket and keeps a per-session budget of experts resident,
paging the rest in on demand.

${qm__pkg_backend}

Contents: qmoed (daemon), qmoectl (operator CLI), qmoe-bank (bank files),
libqmoe-client (shared and static C client library, header, pkg-config
file), systemd units (qmoed.service, qmoed.socket), sysusers.d and
tmpfiles.d snippets, man pages and an example /etc/qmoed/qmoed.json.")

set(CPACK_DEBIAN_PACKAGE_NAME qmoed)
set(CPACK_DEBIAN_PACKAGE_RELEASE 1)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_PACKAGE_SECTION misc)
set(CPACK_DEBIAN_PACKAGE_PRIORITY optional)
# The static library and qmoe-client.pc (Requires.private: libcjson) want
# these to build against; running needs neither.
set(CPACK_DEBIAN_PACKAGE_SUGGESTS "pkg-config, libcjson-dev")
set(CPACK_DEBIAN_PACKAGE_RECOMMENDS "systemd")

# Dependencies from the binaries themselves when dpkg-shlibdeps is here;
# otherwise the list a Debian 12 build links (libc6, libuv1, libcjson1,
# liburing2 with io_uring for the disk source, plus libstdc++6/libgcc-s1
# with the CUDA backend).
find_program(QMOE_DPKG_SHLIBDEPS dpkg-shlibdeps)
mark_as_advanced(QMOE_DPKG_SHLIBDEPS)
if(QMOE_DPKG_SHLIBDEPS)
  set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
else()
  set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS OFF)
  set(CPACK_DEBIAN_PACKAGE_DEPENDS "libc6 (>= 2.34), libuv1 (>= 1.44), libcjson1 (>= 1.7.15)")
  if(QMOE_HAVE_LIBURING)
    string(APPEND CPACK_DEBIAN_PACKAGE_DEPENDS ", liburing2 (>= 2.1)")
  endif()
  if(QMOE_HAVE_CUDA)
    string(APPEND CPACK_DEBIAN_PACKAGE_DEPENDS ", libstdc++6 (>= 12), libgcc-s1 (>= 3.0)")
  endif()
endif()
# libqmoe-client.so.1 ships in this package: a shlibs file lets other
# packages' dpkg-shlibdeps depend on it.
set(CPACK_DEBIAN_PACKAGE_GENERATE_SHLIBS ON)
set(CPACK_DEBIAN_PACKAGE_GENERATE_SHLIBS_POLICY ">=")
set(CPACK_DEBIAN_PACKAGE_CONTROL_STRICT_PERMISSION ON)

# The package's unit: qmoed.service.in configured for /usr/sbin/qmoed and
# /etc/qmoed/qmoed.json (the build tree's copy carries the build's prefix).
function(qm__pkg_configure_unit)
  set(CMAKE_INSTALL_FULL_SBINDIR ${qm__pkg_prefix}/${CMAKE_INSTALL_SBINDIR})
  if(IS_ABSOLUTE "${CMAKE_INSTALL_SBINDIR}")
    set(CMAKE_INSTALL_FULL_SBINDIR ${CMAKE_INSTALL_SBINDIR})
  endif()
  set(CMAKE_INSTALL_FULL_SYSCONFDIR /etc)
  configure_file(${CMAKE_SOURCE_DIR}/systemd/qmoed.service.in
                 ${CMAKE_BINARY_DIR}/packaging/qmoed.service @ONLY)
endfunction()
set(QMOE_PKG_UNIT "")
if(EXISTS ${CMAKE_SOURCE_DIR}/systemd/qmoed.service.in AND DEFINED QMOE_SYSTEMD_UNITDIR)
  qm__pkg_configure_unit()
  set(QMOE_PKG_UNIT ${CMAKE_BINARY_DIR}/packaging/qmoed.service)
endif()

# Maintainer scripts and the conffiles list (dpkg keeps a locally edited
# /etc/qmoed/qmoed.json across upgrades and asks before replacing it).
file(WRITE ${CMAKE_BINARY_DIR}/packaging/conffiles "/etc/qmoed/qmoed.json\n")
# libqmoe-client.so.1 lands in a linker directory: have dpkg run ldconfig.
file(WRITE ${CMAKE_BINARY_DIR}/packaging/triggers "activate-noawait ldconfig\n")
set(CPACK_DEBIAN_PACKAGE_CONTROL_EXTRA
    ${CMAKE_BINARY_DIR}/packaging/conffiles
    ${CMAKE_BINARY_DIR}/packaging/triggers
    ${CMAKE_CURRENT_LIST_DIR}/postinst
    ${CMAKE_CURRENT_LIST_DIR}/prerm
    ${CMAKE_CURRENT_LIST_DIR}/postrm)

# Values the staging fix-up needs (CPackConfig.cmake passes CPACK_* on).
set(CPACK_QMOE_SYSCONFDIR "${CMAKE_INSTALL_SYSCONFDIR}")
set(CPACK_QMOE_UNITDIR "${QMOE_SYSTEMD_UNITDIR}")
set(CPACK_QMOE_UNIT "${QMOE_PKG_UNIT}")
set(CPACK_PRE_BUILD_SCRIPTS ${CMAKE_CURRENT_LIST_DIR}/stage-fixup.cmake)

# `package_source`: a tarball of the tree without builds and local state.
# The patterns are regexes on full paths: anchor them at the source dir.
set(CPACK_SOURCE_GENERATOR TGZ)
# CPackSourceConfig.cmake gets the values unescaped: hence doubled backslashes.
string(REGEX REPLACE "([][+.*()^$?|\\\\])" "\\\\\\\\\\1" qm__src_re "${CMAKE_SOURCE_DIR}")
set(CPACK_SOURCE_IGNORE_FILES "^${qm__src_re}/(\\\\.git|\\\\.venv|build[^/]*|out|demo)(/|$)"
    "/__pycache__/" "/\\\\.pytest_cache/")

include(CPack)
