// threshold: being written (issue 3)
