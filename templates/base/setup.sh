#!/bin/bash
# Runs inside the new root (chroot, as root, no /proc) after the packages are installed: E2B's
# template conventions. Nothing of AgentENV's goes in here; the tools disk brings init and envd.
set -euo pipefail

# The default user: uid 1000, bash, passwordless sudo.
useradd --uid 1000 --user-group --create-home --home-dir /home/user --shell /bin/bash --groups sudo user
passwd -d user >/dev/null
echo 'user ALL=(ALL:ALL) NOPASSWD: ALL' >/etc/sudoers.d/user
chmod 0440 /etc/sudoers.d/user
passwd -d root >/dev/null
chown -R user:user /home/user

# Places every user may write: /usr/local (npm -g, pip) and /code.
mkdir -p /code
chmod -R 777 /usr/local /code

# Login shells (the SDK runs `/bin/bash -l -c …`) read the user's own files and get a prompt.
cat >>/etc/profile <<'PROFILE'
if [ -f ~/.bashrc ]; then . ~/.bashrc; fi; if [ -f ~/.profile ]; then . ~/.profile; fi
PROFILE
echo "export SHELL='/bin/bash'" >/etc/profile.d/shell.sh
echo "export PS1='\w \$ '" >/etc/profile.d/prompt.sh
echo "export PS1='\w \$ '" >>/etc/profile
echo "export PS1='\w \$ '" >>/root/.bashrc

# The build host's name and resolver stay out of the image: init sets the hostname and writes
# /etc/resolv.conf at boot (aenv.hostname, aenv.dns).
echo sandbox >/etc/hostname
: >/etc/resolv.conf
printf '127.0.0.1\tlocalhost\n127.0.1.1\tsandbox\n::1\t\tlocalhost ip6-localhost ip6-loopback\n' >/etc/hosts
