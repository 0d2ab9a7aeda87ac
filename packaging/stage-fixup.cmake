# packaging/stage-fixup.cmake: run by cpack (CPACK_PRE_BUILD_SCRIPTS) after
# the install into the staging tree, before the .deb is written.
#
# The package installs under /usr, but a build tree configured for another
# prefix (the default /usr/local, as CI's) or with a relative sysconfdir
# stages two things in the wrong place:
#  - files for ${sysconfdir}: a relative "etc" lands in /usr/etc; Debian
#    (and the unit) want /etc. Move them.
#  - qmoed.service: configured at build time with the build's prefix; swap in
#    the copy configured for /usr/sbin/qmoed and /etc/qmoed/qmoed.json.
# Anything unexpected is an error: a package that disagrees with itself must
# not be written.

# Only the .deb installs under /usr; source tarballs and other generators
# are packaged as staged.
if(NOT CPACK_GENERATOR STREQUAL "DEB")
  return()
endif()

set(stage "${CPACK_TEMPORARY_DIRECTORY}")
if(NOT stage OR NOT IS_DIRECTORY "${stage}")
  message(FATAL_ERROR "qmoed packaging: no staging directory (CPACK_TEMPORARY_DIRECTORY='${stage}')")
endif()
set(prefix "${CPACK_PACKAGING_INSTALL_PREFIX}")
if(NOT prefix STREQUAL "/usr")
  message(FATAL_ERROR "qmoed packaging: the .deb installs under /usr, not '${prefix}' (CPACK_PACKAGING_INSTALL_PREFIX)")
endif()

if(NOT IS_ABSOLUTE "${CPACK_QMOE_SYSCONFDIR}")
  set(from "${stage}${prefix}/${CPACK_QMOE_SYSCONFDIR}")
  if(IS_DIRECTORY "${from}")
    file(GLOB entries RELATIVE "${from}" "${from}/*")
    foreach(e IN LISTS entries)
      if(EXISTS "${stage}/etc/${e}")
        message(FATAL_ERROR "qmoed packaging: both ${prefix}/${CPACK_QMOE_SYSCONFDIR}/${e} and /etc/${e} staged")
      endif()
      file(MAKE_DIRECTORY "${stage}/etc")
      file(RENAME "${from}/${e}" "${stage}/etc/${e}")
    endforeach()
    file(REMOVE_RECURSE "${from}")
  endif()
endif()

if(CPACK_QMOE_UNIT)
  if(IS_ABSOLUTE "${CPACK_QMOE_UNITDIR}")
    set(unitdir "${stage}${CPACK_QMOE_UNITDIR}")
  else()
    set(unitdir "${stage}${prefix}/${CPACK_QMOE_UNITDIR}")
  endif()
  if(NOT EXISTS "${unitdir}/qmoed.service")
    message(FATAL_ERROR "qmoed packaging: ${unitdir}/qmoed.service was not staged")
  endif()
  file(COPY_FILE "${CPACK_QMOE_UNIT}" "${unitdir}/qmoed.service")
endif()

if(NOT EXISTS "${stage}/etc/qmoed/qmoed.json")
  message(FATAL_ERROR "qmoed packaging: /etc/qmoed/qmoed.json (a conffile) was not staged")
endif()
