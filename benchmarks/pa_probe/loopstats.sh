#!/bin/bash
# loopstats.sh DIR: instruction mix of the partition kernel's main loop in DIR/k.ptx
f=$1/k.ptx; a=$(grep -n '^\$L__BB0_1:' $f | cut -d: -f1); b=$(grep -n 'bra 	\$L__BB0_1;' $f | cut -d: -f1)
echo "loop instrs: $(sed -n ${a},${b}p $f | grep -v '^\s*//\|^\s*\.loc\|^\s*\.reg\|^\s*[{}]\s*$\|^\$L' | grep -c .)"
sed -n ${a},${b}p $f | grep -o "st.shared[.a-z0-9]*\|ldmatrix[.a-z0-9]*\|cvt[.a-z0-9]*\|selp[.a-z0-9]*\|max[.a-z0-9]*\|mma[.a-z0-9]*\|ld.shared[.a-z0-9]*\|cp.async[.a-z0-9]*\|bar.sync" | sort | uniq -c | tr '\n' ';'; echo
