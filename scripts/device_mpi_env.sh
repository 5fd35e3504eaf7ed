# Sourced by the device scripts that start MPI jobs: Open MPI from the
# Debian packages carried in .mpi/ (see scripts/device_dist.sh), unpacked
# into a prefix of its own and relocated there. Sets MPIRUN_BASE.
P=/tmp/ompi
mkdir -p $P && for d in .mpi/*.deb; do dpkg -x "$d" $P; done
export PATH=$P/usr/bin:$PATH
export LD_LIBRARY_PATH=$P/usr/lib/x86_64-linux-gnu:$P/usr/lib/x86_64-linux-gnu/openmpi/lib:$P/usr/lib/x86_64-linux-gnu/pmix2/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export OPAL_PREFIX=$P/usr OPAL_LIBDIR=$P/usr/lib/x86_64-linux-gnu/openmpi/lib OPAL_SYSCONFDIR=$P/etc/openmpi OPAL_DATADIR=$P/usr/share/openmpi OPAL_PKGDATADIR=$P/usr/share/openmpi
export PMIX_PREFIX=$P/usr/lib/x86_64-linux-gnu/pmix2 PMIX_INSTALL_PREFIX=$P/usr/lib/x86_64-linux-gnu/pmix2
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mca_base_component_show_load_errors=0
export PMIX_MCA_pcompress_base_silence_warning=1
MPIRUN_BASE="orterun --oversubscribe --bind-to none"
